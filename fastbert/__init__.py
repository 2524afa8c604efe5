"""fastbert: a BERT encoder for PyTorch on fused kernels, with a naive reference behind every one."""
from fastbert import dispatch, ops
from fastbert.config import BertConfig
from fastbert.encode import encode
from fastbert.dispatch import BackendUnavailable, use_backend
from fastbert.heads import (BertForMaskedLM, BertForPreTraining, BertForQuestionAnswering,
                            BertForSequenceClassification, BertForTokenClassification)
from fastbert.integrations.transformers import clear_prepared_weights, optimize, register_attention
from fastbert.memory import keep_freed_memory
from fastbert.model import BertModel, BertModelOutput, BertPreTrainedModel
from fastbert.quantization import quantize

__version__ = "0.1.0"
__all__ = ["BertConfig", "BertModel", "BertModelOutput", "BertPreTrainedModel", "BertForMaskedLM",
           "BertForPreTraining", "BertForSequenceClassification", "BertForTokenClassification",
           "BertForQuestionAnswering", "BackendUnavailable", "clear_prepared_weights", "dispatch", "encode", "keep_freed_memory", "ops", "optimize", "quantize",
           "register_attention", "use_backend"]
