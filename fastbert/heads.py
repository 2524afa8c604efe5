"""Task heads on the encoder, built as transformers builds them: HF's module and parameter names,
forward arguments, output fields and losses, so checkpoints and training code carry over unchanged.

Heads compute logits at every position, as HF does. Where the encoder ran padding-free its pad
positions hold zeros, so logits at pad positions differ from HF's; every loss is HF's (a loss that scores
pad positions, labels other than -100 there, runs the pad tokens through the encoder as HF does). Shapes: B batch, S sequence, H hidden, V vocab, L num_labels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastbert import ops
from fastbert.config import BertConfig
from fastbert.model import BertModel, BertPreTrainedModel, ModelOutput, refuse_skipped_hooks

States = tuple[torch.Tensor, ...] | None


@dataclass
class LogitsOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: States = None
    attentions: States = None


class MaskedLMOutput(LogitsOutput):
    """logits: [B, S, V]"""


class SequenceClassifierOutput(LogitsOutput):
    """logits: [B, L]"""


class TokenClassifierOutput(LogitsOutput):
    """logits: [B, S, L]"""


@dataclass
class BertForPreTrainingOutput(ModelOutput):
    loss: torch.Tensor | None = None
    prediction_logits: torch.Tensor | None = None  # [B, S, V]
    seq_relationship_logits: torch.Tensor | None = None  # [B, 2]
    hidden_states: States = None
    attentions: States = None


@dataclass
class QuestionAnsweringModelOutput(ModelOutput):
    loss: torch.Tensor | None = None
    start_logits: torch.Tensor | None = None  # [B, S]
    end_logits: torch.Tensor | None = None  # [B, S]
    hidden_states: States = None
    attentions: States = None


def linear(layer: nn.Linear, x: torch.Tensor, prepared: ops.PreparedWeights | None = None) -> torch.Tensor:
    return ops.dense(x, layer.weight, layer.bias, prepared=prepared)


def classifier_dropout(config: BertConfig) -> float:
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob


# ---------------------------------------------------------------------------------- head modules


class BertPredictionHeadTransform(nn.Module):
    calls = ("LayerNorm",)  # children called as modules (their hooks fire); the kernels read the others' weights

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.approximate = config.gelu_approximate
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.prepared = ops.PreparedWeights()

    def forward(self, x):
        # No residual here, so a plain LayerNorm rather than the fused add_layer_norm.
        return self.LayerNorm(ops.dense(x, self.dense.weight, self.dense.bias, "gelu", self.approximate, self.prepared))


class BertLMPredictionHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        # The model ties decoder.weight to the word embeddings and decoder.bias to `bias` (tie_weights).
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.prepared = ops.PreparedWeights()  # the decoder's packed weight, for inference

    def forward(self, x):
        return linear(self.decoder, self.transform(x), self.prepared)  # [B, S, V]


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)

    def forward(self, sequence_output):
        return self.predictions(sequence_output)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, sequence_output, pooled_output):
        return self.predictions(sequence_output), linear(self.seq_relationship, pooled_output)  # [B, S, V], [B, 2]


_MLM_TIES = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
             "cls.predictions.decoder.bias": "cls.predictions.bias"}


def _finish(out: ModelOutput, return_dict: bool | None, config):
    return out if config.output_setting("return_dict", return_dict) else out.to_tuple()


def scores_pads(labels, attention_mask) -> bool:
    """Labels scored at pad positions (not -100 there): transformers' loss then reads logits of pad tokens
    run through the encoder, so they must run through it here too (padding-free, they would hold zeros).
    Per-token labels are any shape of B x S numbers ([B * S], [B, S, 1]): the losses flatten them."""
    if labels is None or attention_mask is None or labels.numel() != attention_mask.numel():
        return False
    if torch.compiler.is_compiling():
        return False  # compiled, the encoder runs padded anyway (and a data-dependent branch cannot be traced)
    return bool(((attention_mask.reshape(-1) == 0) & (labels.reshape(-1) != -100)).any())


# ---------------------------------------------------------------------------------- models


class BertForMaskedLM(BertPreTrainedModel):
    _tied_weights_keys = _MLM_TIES

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.init_weights(self.cls)  # the encoder initialized itself
        self.tie_weights()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_hidden_states: bool | None = None, output_attentions: bool | None = None,
                return_dict: bool | None = None):
        """labels [B, S]: token ids to predict, -100 where no prediction is scored."""
        refuse_skipped_hooks(self)  # the head's own layers too
        out = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
                        inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states,
                        output_attentions=output_attentions, return_dict=True,
                        allow_unpadding=not scores_pads(labels, attention_mask))
        logits = self.cls(out.last_hidden_state)  # [B, S, V]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return _finish(MaskedLMOutput(loss, logits, out.hidden_states, out.attentions), return_dict, self.config)


class BertForPreTraining(BertPreTrainedModel):
    _tied_weights_keys = _MLM_TIES

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.init_weights(self.cls)
        self.tie_weights()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, next_sentence_label=None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, return_dict: bool | None = None):
        """labels [B, S] as for BertForMaskedLM; next_sentence_label [B]: 0 = B follows A, 1 = random.
        The loss (MLM + NSP) needs both, as in transformers."""
        refuse_skipped_hooks(self)  # the head's own layers too
        out = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
                        inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states,
                        output_attentions=output_attentions, return_dict=True,
                        allow_unpadding=not scores_pads(labels, attention_mask))
        prediction_logits, seq_logits = self.cls(out.last_hidden_state, out.pooler_output)
        loss = None
        if labels is not None and next_sentence_label is not None:
            mlm = F.cross_entropy(prediction_logits.reshape(-1, prediction_logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
            nsp = F.cross_entropy(seq_logits.reshape(-1, 2), next_sentence_label.reshape(-1))
            loss = mlm + nsp
        return _finish(BertForPreTrainingOutput(loss, prediction_logits, seq_logits, out.hidden_states, out.attentions),
                       return_dict, self.config)


class _Classifier(BertPreTrainedModel):
    """The encoder, dropout and a `classifier` linear layer: what sequence and token classification share."""

    calls = ("dropout",)

    def __init__(self, config: BertConfig, add_pooling_layer: bool):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=add_pooling_layer)
        self.dropout = nn.Dropout(classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights(self.classifier)


class BertForSequenceClassification(_Classifier):
    def __init__(self, config: BertConfig):
        super().__init__(config, add_pooling_layer=True)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_hidden_states: bool | None = None, output_attentions: bool | None = None,
                return_dict: bool | None = None):
        """labels [B]: class ids (single label), floats (regression), or [B, L] floats (multi label)."""
        refuse_skipped_hooks(self)  # the head's own layers too
        out = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
                        inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states,
                        output_attentions=output_attentions, return_dict=True)
        logits = linear(self.classifier, self.dropout(out.pooler_output))  # [B, L]
        loss = self.loss(logits, labels) if labels is not None else None
        return _finish(SequenceClassifierOutput(loss, logits, out.hidden_states, out.attentions), return_dict, self.config)

    def loss(self, logits, labels):
        cfg = self.config
        if cfg.problem_type is None:
            # Inferred at the first labelled call and kept in the config, as transformers does, so a
            # saved config tells transformers the same thing.
            if self.num_labels == 1:
                cfg.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                cfg.problem_type = "single_label_classification"
            else:
                cfg.problem_type = "multi_label_classification"
        if cfg.problem_type == "regression":
            if self.num_labels == 1:
                return F.mse_loss(logits.squeeze(), labels.squeeze())
            return F.mse_loss(logits, labels)
        if cfg.problem_type == "single_label_classification":
            return F.cross_entropy(logits.reshape(-1, self.num_labels), labels.reshape(-1))
        return F.binary_cross_entropy_with_logits(logits, labels)


class BertForTokenClassification(_Classifier):
    def __init__(self, config: BertConfig):
        super().__init__(config, add_pooling_layer=False)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_hidden_states: bool | None = None, output_attentions: bool | None = None,
                return_dict: bool | None = None):
        """labels [B, S]: class ids, -100 where no prediction is scored (pads, word-piece continuations)."""
        refuse_skipped_hooks(self)  # the head's own layers too
        out = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
                        inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states,
                        output_attentions=output_attentions, return_dict=True,
                        allow_unpadding=not scores_pads(labels, attention_mask))
        logits = linear(self.classifier, self.dropout(out.last_hidden_state))  # [B, S, L]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, self.num_labels), labels.reshape(-1), ignore_index=-100)
        return _finish(TokenClassifierOutput(loss, logits, out.hidden_states, out.attentions), return_dict, self.config)


class BertForQuestionAnswering(BertPreTrainedModel):
    def __init__(self, config: BertConfig):
        super().__init__(config)
        if config.num_labels != 2:
            raise ValueError(f"BertForQuestionAnswering needs num_labels == 2 (start and end logits), got {config.num_labels}")
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights(self.qa_outputs)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                start_positions=None, end_positions=None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, return_dict: bool | None = None):
        """start_positions, end_positions [B]: token index of the answer span; an index past the input
        is ignored. The loss needs both, as in transformers."""
        with_loss = start_positions is not None and end_positions is not None
        # transformers' span loss takes its softmax over every position, pads included, so with a loss
        # the pad tokens must run through the encoder as they do there.
        refuse_skipped_hooks(self)  # the head's own layers too
        out = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
                        inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states,
                        output_attentions=output_attentions, return_dict=True,
                        allow_unpadding=not with_loss)
        logits = linear(self.qa_outputs, out.last_hidden_state)  # [B, S, 2]
        start_logits, end_logits = (t.contiguous() for t in logits.unbind(-1))  # [B, S] each
        loss = None
        if with_loss:
            # A position past the input is clamped to S, and class S is ignored.
            s = start_logits.shape[1]
            start = start_positions.reshape(-1).clamp(0, s)
            end = end_positions.reshape(-1).clamp(0, s)
            loss = (F.cross_entropy(start_logits, start, ignore_index=s) + F.cross_entropy(end_logits, end, ignore_index=s)) / 2
        return _finish(QuestionAnsweringModelOutput(loss, start_logits, end_logits, out.hidden_states, out.attentions),
                       return_dict, self.config)
