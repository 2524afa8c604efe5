"""fastbert.ops: the fused ops, each a public function that validates its inputs and dispatches."""
from fastbert.ops import encoder_layer  # a layer of a planned forward in one call (model.py)
from fastbert.ops.add_layer_norm import add_layer_norm
from fastbert.ops.attention import attention, varlen_attention
from fastbert.ops.bias_gelu import bias_gelu
from fastbert.ops.dense import dense
from fastbert.ops.prepared import PreparedWeights
from fastbert.ops.qkv_projection import qkv_projection
from fastbert.ops.quantized_dense import quantized_dense
from fastbert.ops.reference import QuantizedRows

__all__ = ["add_layer_norm", "attention", "varlen_attention", "bias_gelu", "dense", "qkv_projection", "quantized_dense",
           "encoder_layer", "PreparedWeights", "QuantizedRows"]
