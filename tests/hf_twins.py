"""fastbert and transformers models with identical weights, for parity tests."""
import torch
import transformers

import fastbert


def twins(attn_implementation="sdpa", model_class="BertModel", **config):
    """(fastbert model, transformers model) of `model_class` (BertModel or a BertFor* name) in eval
    mode with the same random weights."""
    cfg = fastbert.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **config)
    ours = getattr(fastbert, model_class)(cfg).eval()
    hf_cfg = transformers.BertConfig(**cfg.to_dict())
    theirs = getattr(transformers, model_class)._from_config(hf_cfg, attn_implementation=attn_implementation).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours, theirs


def padded_batch(vocab_size, lengths, type_vocab_size=2):
    """input_ids, attention_mask, token_type_ids for sequences of `lengths`, right-padded."""
    seq = max(lengths)
    ids = torch.randint(1, vocab_size, (len(lengths), seq))
    mask = (torch.arange(seq)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask  # pad id 0
    types = torch.randint(0, type_vocab_size, ids.shape) * mask
    return ids, mask, types
