"""fastbert: a BERT encoder for PyTorch on fused kernels, with a naive reference behind every one."""
from fastbert import dispatch, ops
from fastbert.config import BertConfig
from fastbert.dispatch import BackendUnavailable, use_backend
from fastbert.model import BertModel, BertModelOutput, BertPreTrainedModel

__version__ = "0.1.0"
__all__ = ["BertConfig", "BertModel", "BertModelOutput", "BertPreTrainedModel", "BackendUnavailable",
           "dispatch", "ops", "use_backend"]
