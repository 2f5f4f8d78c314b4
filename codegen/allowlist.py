"""Everything a checkpoint may name, as data: the functions, classes and ops its stage and graph
structures call, the torch.nn classes its module skeletons rebuild and the optimizers it makes.

Why: an attacker can rewrite every file of a checkpoint, its marker included, so whatever a name
in it resolves to runs. Walking attributes from `torch` reaches `torch.os.system`, `torch.utils.
collect_env.run` and code compilers, and importing a module the checkpoint names runs that
module. So a name resolves only by exact match against the lists below (or the caller's
`trusted_functions`); nothing is imported and no attribute chain from the data is walked. The
listed names are looked up once, each in a module stagewise imported itself.

The lists hold what the stage and graph data of the test models and Hugging Face models
(tests/models/, tests/hf.py) name, under the qualified names torch.fx records, and their close
kin. Each group's safety:
- ATen ops (`torch.ops.aten`, any overload but `ATEN_REFUSED`): C++ kernels over tensors and
  numbers. The refused ones open or write files (`from_file` maps a file, which a later `copy_`
  overwrites), print, wait on futures or change the process's grad mode or random seed. Other op
  namespaces may run Python (`torch.library` ops), so only the caller's trusted ops load.
- torch, torch.functional, torch.nn.functional, torch._C._nn: tensor math and losses; none reads
  or writes files, imports, compiles or changes global state.
- _operator (Python's operators, as torch.fx records them), math: arithmetic, comparison and
  indexing, never `attrgetter` / `methodcaller` / `call`, which reach any attribute or call.
- builtins: conversions, containers, `len`, `min`, `getattr` (its attribute name is checked:
  `allowed_attribute`), never `eval`, `exec`, `open` or `__import__`.
- stagewise: the keyed random streams the random-op pass writes into stage code, and the
  tensor-parallel all-reduces (f and g) a split stage's code calls.
- classes (annotations, `isinstance`): torch's tensor, size, dtype and device and Python's plain types.
- torch.nn leaves: modules whose constructors take plain values and whose forward is tensor
  math; no containers, lazy modules or modules that take other modules or callables.
- torch.optim's optimizers.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping

import torch
import torch.nn.functional
import torch.optim

import stagewise.ir.random_streams  # noqa: F401 - its functions are listed by name
import stagewise.ir.tensor_parallel_ops  # noqa: F401 - as random_streams

ATEN_REFUSED = frozenset({
    "from_file", "save", "_print", "warn", "wait", "set_", "set_data", "record_stream", "set_grad_enabled",
    "manual_seed", "seed", "_cufft_set_plan_cache_max_size", "_cufft_clear_plan_cache", "_test_warn_in_autograd",
})

FUNCTIONS: Mapping[str, str] = {
    "torch": """
        abs acos add addcdiv addcmul addmm all amax amin any arange argmax argmin argsort as_strided atan atan2
        baddbmm batch_norm bernoulli bilinear bincount bmm broadcast_to bucketize cat ceil celu_ channel_shuffle
        chunk clamp clamp_max clamp_min clip clone complex concat concatenate conj conv1d conv2d conv3d
        conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d cos cosh cosine_similarity count_nonzero
        cross cummax cummin cumprod cumsum detach diag diag_embed diagonal diff div dot dropout embedding empty
        empty_like eq erf erfinv exp exp2 expm1 eye flatten flip floor floor_divide fmod full full_like gather
        ge group_norm gt hardshrink heaviside histc hstack hypot index_select instance_norm isclose isfinite
        isinf isnan kron layer_norm le lerp linspace log log10 log1p log2 log_softmax logaddexp logcumsumexp
        logical_and logical_not logical_or logical_xor logsumexp lt masked_fill masked_select matmul max
        maximum mean median min minimum mm movedim mul multinomial nan_to_num narrow native_channel_shuffle
        native_layer_norm ne neg nonzero normal numel ones ones_like outer pairwise_distance pdist permute
        pixel_shuffle pixel_unshuffle polar pow prelu prod rand rand_like randint randint_like randn randn_like
        randperm reciprocal relu relu_ remainder repeat_interleave reshape rms_norm roll rot90 round rrelu_
        rsqrt scalar_tensor scatter scatter_add searchsorted select selu_ sigmoid sign sin sinh slice_scatter
        softmax sort sqrt square squeeze stack std sub sum swapaxes sym_float sym_int sym_ite sym_max sym_min
        sym_not sym_sum t take tan tanh tensor threshold threshold_ tile topk transpose tril triu true_divide
        trunc unbind unflatten unsqueeze var var_mean vstack where zeros zeros_like
    """,
    "torch.functional": """
        atleast_1d atleast_2d block_diag broadcast_tensors cartesian_prod cdist einsum meshgrid norm split
        tensordot unique
    """,
    "torch.nn.functional": """
        _threshold adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d
        adaptive_max_pool3d affine_grid alpha_dropout batch_norm binary_cross_entropy
        binary_cross_entropy_with_logits celu cosine_embedding_loss cross_entropy dropout dropout1d dropout2d
        dropout3d elu embedding embedding_bag feature_alpha_dropout fold gaussian_nll_loss glu grid_sample
        group_norm gumbel_softmax hardsigmoid hardswish hardtanh hinge_embedding_loss huber_loss instance_norm
        interpolate kl_div l1_loss layer_norm leaky_relu local_response_norm log_softmax lp_pool1d lp_pool2d
        margin_ranking_loss max_pool1d max_pool2d max_pool3d mish mse_loss multi_head_attention_forward
        multi_margin_loss multilabel_margin_loss multilabel_soft_margin_loss nll_loss normalize pad
        poisson_nll_loss relu relu6 rms_norm rrelu selu sigmoid silu smooth_l1_loss soft_margin_loss softmax
        softmin softsign tanh tanhshrink triplet_margin_loss unfold upsample upsample_bilinear upsample_nearest
    """,
    "torch._C._nn": """
        avg_pool2d avg_pool3d elu_ gelu hardtanh_ leaky_relu_ linear log_sigmoid one_hot
        scaled_dot_product_attention softplus softshrink
    """,
    "_operator": """
        abs add and_ contains eq floordiv ge getitem gt iadd iand ifloordiv ilshift imatmul imod imul index
        invert ior ipow irshift is_ is_not isub itruediv ixor le lshift lt matmul mod mul ne neg not_ or_ pos
        pow rshift setitem sub truediv truth xor
    """,
    "math": "ceil cos exp fabs floor isfinite isinf isnan log log10 log2 pow prod sin sqrt tanh trunc",
    "builtins": "abs bool dict float getattr int isinstance len list max min range slice str tuple",
    "stagewise.ir.random_streams": "keyed keyed_dropout",
    "stagewise.ir.tensor_parallel_ops": "tp_enter tp_all_reduce",
}
CLASSES: Mapping[str, str] = {
    "torch": "Tensor Size dtype device",
    "builtins": "bool dict float int list slice str tuple",
}
ENUMS: Mapping[str, str] = {"stagewise.ir.random_streams": "TorchRandom"}

LEAF_MODULES: Mapping[str, str] = {
    "torch.nn.modules.activation": """
        CELU ELU GELU GLU Hardshrink Hardsigmoid Hardswish Hardtanh LeakyReLU LogSigmoid LogSoftmax Mish
        MultiheadAttention PReLU RReLU ReLU ReLU6 SELU SiLU Sigmoid Softmax Softmax2d Softmin Softplus
        Softshrink Softsign Tanh Tanhshrink Threshold
    """,
    "torch.nn.modules.batchnorm": "BatchNorm1d BatchNorm2d BatchNorm3d",
    "torch.nn.modules.channelshuffle": "ChannelShuffle",
    "torch.nn.modules.conv": "Conv1d Conv2d Conv3d ConvTranspose1d ConvTranspose2d ConvTranspose3d",
    "torch.nn.modules.distance": "CosineSimilarity PairwiseDistance",
    "torch.nn.modules.dropout": "AlphaDropout Dropout Dropout1d Dropout2d Dropout3d FeatureAlphaDropout",
    "torch.nn.modules.flatten": "Flatten Unflatten",
    "torch.nn.modules.fold": "Fold Unfold",
    "torch.nn.modules.instancenorm": "InstanceNorm1d InstanceNorm2d InstanceNorm3d",
    "torch.nn.modules.linear": "Bilinear Identity Linear",
    "torch.nn.modules.loss": """
        BCELoss BCEWithLogitsLoss CosineEmbeddingLoss CrossEntropyLoss GaussianNLLLoss HingeEmbeddingLoss
        HuberLoss KLDivLoss L1Loss MSELoss MarginRankingLoss MultiLabelMarginLoss MultiLabelSoftMarginLoss
        MultiMarginLoss NLLLoss PoissonNLLLoss SmoothL1Loss SoftMarginLoss TripletMarginLoss
    """,
    "torch.nn.modules.normalization": "GroupNorm LayerNorm LocalResponseNorm RMSNorm",
    "torch.nn.modules.padding": """
        CircularPad1d CircularPad2d CircularPad3d ConstantPad1d ConstantPad2d ConstantPad3d ReflectionPad1d
        ReflectionPad2d ReflectionPad3d ReplicationPad1d ReplicationPad2d ReplicationPad3d ZeroPad1d ZeroPad2d
        ZeroPad3d
    """,
    "torch.nn.modules.pixelshuffle": "PixelShuffle PixelUnshuffle",
    "torch.nn.modules.pooling": """
        AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d AdaptiveMaxPool1d AdaptiveMaxPool2d
        AdaptiveMaxPool3d AvgPool1d AvgPool2d AvgPool3d LPPool1d LPPool2d LPPool3d MaxPool1d MaxPool2d MaxPool3d
    """,
    "torch.nn.modules.rnn": "GRU GRUCell LSTM LSTMCell RNN RNNCell",
    "torch.nn.modules.sparse": "Embedding EmbeddingBag",
    "torch.nn.modules.upsampling": "Upsample UpsamplingBilinear2d UpsamplingNearest2d",
}
OPTIMIZERS: Mapping[str, str] = {  # under the names they are saved by, and torch.optim's public ones
    "torch.optim": "ASGD Adadelta Adafactor Adagrad Adam AdamW Adamax Muon NAdam RAdam RMSprop Rprop SGD SparseAdam",
    "torch.optim.adadelta": "Adadelta", "torch.optim.adagrad": "Adagrad",
    "torch.optim.adam": "Adam", "torch.optim.adamax": "Adamax", "torch.optim.adamw": "AdamW",
    "torch.optim.asgd": "ASGD", "torch.optim.nadam": "NAdam", "torch.optim.radam": "RAdam",
    "torch.optim.rmsprop": "RMSprop", "torch.optim.rprop": "Rprop", "torch.optim.sgd": "SGD",
    "torch.optim.sparse_adam": "SparseAdam",
}
# tensor attributes and methods a graph may read or call (`x.shape`, `x.view(...)`): torch.Tensor's
# public names but those that reach storage, raw pointers or streams (a storage maps files), numpy
# (`tofile`), another class, autograd hooks and the backward pass, and swaps of a tensor's data
TENSOR_ATTRIBUTES_REFUSED = frozenset({
    "storage", "untyped_storage", "storage_type", "data_ptr", "const_data_ptr", "mutable_data_ptr", "record_stream",
    "numpy", "to_dlpack", "as_subclass", "new", "register_hook", "register_post_accumulate_grad_hook", "grad_fn",
    "retain_grad", "backward", "apply_", "map_", "map2_", "set_", "share_memory_", "module_load", "pin_memory",
})


def allowed_function(name: str) -> object | None:
    """The listed function or class of this exact qualified name, else None."""
    return _table("functions").get(name) or _table("classes").get(name)


def allowed_class(name: str) -> type | None:
    """The listed class (a node's annotation) of this exact qualified name, else None."""
    found = _table("classes").get(name)
    return found if isinstance(found, type) else None


def allowed_enum(name: str) -> type | None:
    """The listed enum class of this exact qualified name, else None."""
    found = _table("enums").get(name)
    return found if isinstance(found, type) else None


def allowed_leaf(name: str) -> type[torch.nn.Module] | None:
    """The listed torch.nn class of this exact qualified name, else None."""
    found = _table("leaves").get(name)
    return found if isinstance(found, type) and issubclass(found, torch.nn.Module) else None


def allowed_optimizer(name: str) -> type[torch.optim.Optimizer] | None:
    """The listed torch.optim optimizer of this exact qualified name, else None."""
    found = _table("optimizers").get(name)
    return found if isinstance(found, type) and issubclass(found, torch.optim.Optimizer) else None


def allowed_aten(op_name: str) -> bool:
    """Whether the ATen op of this name (the packet's, `mm` of `aten.mm.default`) may load."""
    return op_name not in ATEN_REFUSED


def allowed_attribute(name: str) -> bool:
    """Whether a graph may read or call the attribute `name` of a value (module docstring)."""
    return not name.startswith("_") and name in _TENSOR_ATTRIBUTES and name not in TENSOR_ATTRIBUTES_REFUSED


_TENSOR_ATTRIBUTES = frozenset(dir(torch.Tensor))
_GROUPS = {"functions": FUNCTIONS, "classes": CLASSES, "enums": ENUMS, "leaves": LEAF_MODULES,
           "optimizers": OPTIMIZERS}


@functools.cache
def _table(group: str) -> dict[str, object]:
    """{qualified name: object} of one group: each listed name looked up in its module, which
    stagewise imported (sys.modules; nothing is imported here). Names this torch lacks are left out."""
    table = {}
    for module_name, names in _GROUPS[group].items():
        module = sys.modules.get(module_name)
        for name in names.split():
            found = getattr(module, name, None)
            if found is not None:
                table[f"{module_name}.{name}"] = found
    return table
