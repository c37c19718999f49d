"""Eleven real models from tiny configs (no download), and the workloads run on them.

The models are HF transformers' GPT-2, BERT, DistilBERT, Llama, T5, BART and ViT, and timm's
ResNet with GroupNorm, ResNet with BatchNorm (run with ``replace_all_batch_norm_modules_``, so
each example is normalised by its own statistics, and in eval mode), ViT and ConvNeXt.  Each is
built with ``torch.manual_seed`` from a config object: hidden size 16, one or two layers,
sequences of 5 tokens, 16-pixel images (32 for ConvNeXt, whose four stages halve it), batches of 3.  Everything runs in float32 in eval mode
(dropout off), except the replaced-BatchNorm ResNet, which runs in training mode (batch
statistics, one example at a time).

A ``Spec`` says how to call one model on ONE example (``logits(model, x)``, ``x`` without a
batch dim) and from its input embeddings or pixels (``from_embeds``), with the ``loss`` of one
example.  The workloads (``per_sample_grads``, ``ensemble``, ``jvp_embeds``, ``vjp_embeds``)
take a transform library (``functrans`` or ``torch.func``) so that the tests and
``benchmarks/real_models.py`` run the same code; ``loop_*`` are the oracles: plain eager
PyTorch, one example (or one model) at a time.

Optional packages: ``import_transformers()`` / ``import_timm()`` raise ``ImportError`` with the
reason when a package is not installed (tests turn it into a skip), ``RuntimeError`` when it is
installed but does not import (a failure).  Note [torchvision beside a CPU
torch]: timm imports torchvision, and so does transformers once torchvision is installed.  The
torchvision wheels on PyPI for Linux are CUDA builds; beside a CPU build of torch their C
extension cannot load (it needs ``libc10_cuda.so``), and torchvision's Python part then fails on
an unconditional ``register_fake("torchvision::nms")`` for an op that the extension would have
defined.  ``_torchvision_importable()`` defines the schemas of the two ops it names (no kernels:
calling them still fails, as it would anyway without the extension), so that the Python part
imports; neither timm's models nor transformers' text and ViT models use torchvision's ops.
"""
from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

B = 3          # examples per batch
SEQ = 5        # tokens per example
VOCAB = 32
IMAGE = 16     # pixels per side
CLASSES = 3

_TORCHVISION_SCHEMAS: List[Any] = []   # the Library objects must stay alive


def _torchvision_importable() -> None:
    """See Note [torchvision beside a CPU torch]."""
    if importlib.util.find_spec("torchvision") is None or "torchvision" in sys.modules:
        return
    try:
        importlib.import_module("torchvision")
        return
    except RuntimeError as e:
        if "torchvision::nms does not exist" not in str(e):
            raise ImportError(f"torchvision does not import beside torch "
                              f"{torch.__version__}: {e}") from e
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_SCHEMAS.append(lib)
    importlib.import_module("torchvision")


def import_transformers():
    return _import("transformers")


def import_timm():
    return _import("timm")


def _import(name):
    """The package, or ImportError (a skip) when it is not installed.  An installed package
    that does not import (a dependency missing from scripts/setup.sh's --no-deps list: pyyaml
    once hid every test here as a skip) is a RuntimeError: a failure, never a skip."""
    if importlib.util.find_spec(name) is None:
        raise ImportError(f"{name} is not installed: pip install functrans[models], or "
                          "bash scripts/setup.sh dev")
    try:
        _torchvision_importable()
        module = importlib.import_module(name)
    except ImportError as e:
        raise RuntimeError(f"{name} is installed but does not import ({e}): a dependency is "
                           "missing; scripts/setup.sh installs the models extra's with "
                           "--no-deps") from e
    if name == "transformers":
        module.logging.set_verbosity_error()
    return module


@dataclasses.dataclass
class Spec:
    name: str
    build: Callable[[], torch.nn.Module]        # a new model (the caller seeds)
    example: Callable[[int], Any]               # example i: token ids [SEQ] or pixels [3, H, W]
    target: Callable[[int], torch.Tensor]       # its label(s)
    logits: Callable[[Any, Any], torch.Tensor]  # (model, one example) -> logits
    embeds: Callable[[Any, Any], torch.Tensor]  # (model, one example) -> what from_embeds takes
    from_embeds: Callable[[Any, torch.Tensor], torch.Tensor]   # (model, embeds) -> logits
    train: bool = False                         # run in training mode (BatchNorm statistics)
    attention: bool = False                     # calls F.scaled_dot_product_attention

    def loss(self, model, x, y, *mask):
        out = self.logits(model, x, *mask)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def make(self, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        return self.build().train(self.train)

    def batch(self):
        xs = torch.stack([self.example(i) for i in range(B)])
        ys = torch.stack([self.target(i) for i in range(B)])
        return xs, ys


def _tokens(i):
    return torch.randint(2, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(100 + i))


def _pixels(i, size=IMAGE):
    return torch.randn(3, size, size, generator=torch.Generator().manual_seed(200 + i))


def _token_labels(i):
    return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(300 + i))


def _class_label(i):
    return torch.tensor(i % CLASSES)


def _decoder_ids(x):
    return torch.cat([x.new_zeros(1), x[:-1]])   # shifted right, start token 0


def _text(name, build, *, lm, encoder_decoder=False):
    def logits(model, x, attention_mask=None):
        kw = {"decoder_input_ids": _decoder_ids(x)[None]} if encoder_decoder else {}
        if attention_mask is not None:   # 1: a token, 0: padding
            kw["attention_mask"] = attention_mask[None]
        return model(input_ids=x[None], **kw).logits[0]

    def embeds(model, x):
        return model.get_input_embeddings()(x)

    def from_embeds(model, e, x=None):
        kw = {}
        if encoder_decoder:   # the decoder reads fixed ids: the tangent enters the encoder
            kw["decoder_input_ids"] = torch.zeros(1, SEQ, dtype=torch.long)
        return model(inputs_embeds=e[None], **kw).logits[0]

    return Spec(name, build, _tokens, _token_labels if lm else _class_label, logits, embeds,
                from_embeds, attention=True)


def _image(name, build, *, hf=False, train=False, attention=False, size=IMAGE):
    def logits(model, x):
        out = model(pixel_values=x[None]) if hf else model(x[None])
        return (out.logits if hf else out)[0]

    def embeds(model, x):
        return x

    return Spec(name, build, lambda i: _pixels(i, size), _class_label, logits, embeds, logits,
                train=train, attention=attention)


TRANSFORMERS = ["gpt2", "bert", "distilbert", "llama", "t5", "bart", "hf_vit"]
TIMM = ["timm_resnet_gn", "timm_resnet_bn", "timm_resnet_bn_eval", "timm_vit", "timm_convnext"]
MODELS = TRANSFORMERS + TIMM


def spec(name: str) -> Spec:
    """One model's Spec; ``ImportError`` (with the reason) when its package is missing."""
    return (_transformers_specs() if name in TRANSFORMERS else _timm_specs())[name]


def specs() -> Dict[str, Spec]:
    """The models whose packages import here, by name (the others are left out)."""
    out: Dict[str, Spec] = {}
    for make in (_transformers_specs, _timm_specs):
        try:
            out.update(make())
        except ImportError:
            pass
    return out


def _transformers_specs() -> Dict[str, Spec]:
    T = import_transformers()
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=32)

    def gpt2():
        return T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
            eos_token_id=0))

    def bert():
        return T.BertForSequenceClassification(T.BertConfig(
            vocab_size=VOCAB, max_position_embeddings=16, num_labels=CLASSES, pad_token_id=0,
            **small))

    def distilbert():
        return T.DistilBertForSequenceClassification(T.DistilBertConfig(
            vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, hidden_dim=32,
            max_position_embeddings=16, num_labels=CLASSES, pad_token_id=0))

    def llama():
        return T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=VOCAB, num_key_value_heads=1, max_position_embeddings=16,
            bos_token_id=0, eos_token_id=0, pad_token_id=0, **small))

    def t5():
        return T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
            num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))

    def bart():
        return T.BartForConditionalGeneration(T.BartConfig(
            vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=16, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None))

    def vit():
        return T.ViTForImageClassification(T.ViTConfig(
            image_size=IMAGE, patch_size=8, num_channels=3, num_labels=CLASSES, **small))

    return {
        "gpt2": _text("gpt2", gpt2, lm=True),
        "bert": _text("bert", bert, lm=False),
        "distilbert": _text("distilbert", distilbert, lm=False),
        "llama": _text("llama", llama, lm=True),
        "t5": _text("t5", t5, lm=True, encoder_decoder=True),
        "bart": _text("bart", bart, lm=True, encoder_decoder=True),
        "hf_vit": _image("hf_vit", vit, hf=True, attention=True),
    }


def _timm_specs() -> Dict[str, Spec]:
    timm = import_timm()
    from functrans.nn import replace_all_batch_norm_modules_

    def resnet(norm_layer=None):
        kw = {} if norm_layer is None else {"norm_layer": norm_layer}
        return timm.models.resnet.ResNet(
            block=timm.models.resnet.BasicBlock, layers=[1, 1, 1, 1],
            channels=(8, 8, 16, 16), num_classes=CLASSES, stem_width=8, output_stride=8, **kw)

    def resnet_gn():
        return resnet(lambda c, **kw: torch.nn.GroupNorm(2, c, **kw))

    def resnet_bn():
        return replace_all_batch_norm_modules_(resnet())

    def vit():
        return timm.models.vision_transformer.VisionTransformer(
            img_size=IMAGE, patch_size=8, embed_dim=16, depth=1, num_heads=2, mlp_ratio=2.0,
            num_classes=CLASSES)

    def convnext():
        return timm.models.convnext.ConvNeXt(
            depths=(1, 1, 1, 1), dims=(8, 8, 16, 16), num_classes=CLASSES, patch_size=4,
            output_stride=16)

    return {
        "timm_resnet_gn": _image("timm_resnet_gn", resnet_gn),
        "timm_resnet_bn": _image("timm_resnet_bn", resnet_bn, train=True),
        "timm_resnet_bn_eval": _image("timm_resnet_bn_eval", resnet, train=False),
        "timm_vit": _image("timm_vit", vit, attention=True),
        "timm_convnext": _image("timm_convnext", convnext, size=32),   # stages: 8, 4, 2, 2 px
    }


# --------------------------------------------------------------------------------- workloads
# ``lib`` is functrans or torch.func; every workload returns a pytree of tensors.

def params_and_buffers(model):
    return ({k: v.detach() for k, v in model.named_parameters()},
            {k: v for k, v in model.named_buffers()})


def per_sample_grads(lib, spec: Spec, model, xs, ys, vmap_kwargs: Optional[dict] = None,
                     masks: Optional[torch.Tensor] = None):
    """``masks``: a padding mask per example (text models), passed as ``attention_mask``."""
    params, buffers = params_and_buffers(model)

    def loss(p, x, y, *mask):
        return spec.loss(_Bound(lib, model, p, buffers), x, y, *mask)

    extra = () if masks is None else (masks,)
    return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0) + (0,) * len(extra),
                    **(vmap_kwargs or {}))(params, xs, ys, *extra)


class _Bound:
    """``model`` called through ``lib.functional_call`` with ``params`` and ``buffers``: a
    stand-in for the module that the Spec's functions can call and read embeddings from."""

    def __init__(self, lib, model, params, buffers):
        self.lib, self.model, self.params, self.buffers = lib, model, params, buffers

    def __call__(self, *args, **kwargs):
        return self.lib.functional_call(self.model, (self.params, self.buffers), args, kwargs)

    def get_input_embeddings(self):
        emb = self.model.get_input_embeddings()
        name = next(n for n, m in self.model.named_modules() if m is emb)
        weight = self.params.get(f"{name}.weight", emb.weight)
        return lambda ids: F.embedding(ids, weight, emb.padding_idx)


def loop_per_sample_grads(spec: Spec, model, xs, ys, masks: Optional[torch.Tensor] = None):
    names = [k for k, _ in model.named_parameters()]
    grads = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        mask = () if masks is None else (masks[i],)
        gs = torch.autograd.grad(spec.loss(model, x, y, *mask), list(model.parameters()),
                                 allow_unused=True)
        grads.append({k: torch.zeros_like(p) if g is None else g
                      for k, g, p in zip(names, gs, model.parameters())})
    return {k: torch.stack([g[k] for g in grads]) for k in names}


def ensemble(lib, spec: Spec, models, xs):
    params, buffers = lib.stack_module_state(models)
    base = models[0]

    def logits_all(p, b):
        return torch.stack([spec.logits(_Bound(lib, base, p, b), x) for x in xs])

    return lib.vmap(logits_all)(params, buffers)


def loop_ensemble(spec: Spec, models, xs):
    with torch.no_grad():
        return torch.stack([torch.stack([spec.logits(m, x) for x in xs]) for m in models])


def _embeds_batch(spec: Spec, model, xs):
    with torch.no_grad():
        return torch.stack([spec.embeds(model, x) for x in xs])


def jvp_embeds(lib, spec: Spec, model, es, ts):
    def f(e):
        return spec.from_embeds(model, e)
    return lib.vmap(lambda e, t: lib.jvp(f, (e,), (t,)))(es, ts)


def loop_jvp_embeds(spec: Spec, model, es, ts):
    """Plain forward AD, one example at a time, with attention on its math kernel (the fused
    CPU kernel has no forward formula in PyTorch)."""
    import torch.autograd.forward_ad as fwAD
    from torch.nn.attention import SDPBackend, sdpa_kernel
    outs, tans = [], []
    with sdpa_kernel([SDPBackend.MATH]):
        for e, t in zip(es, ts):
            with fwAD.dual_level():
                o = spec.from_embeds(model, fwAD.make_dual(e, t))
                p, tan = fwAD.unpack_dual(o)
            outs.append(p.detach())
            tans.append(tan.detach())
    return torch.stack(outs), torch.stack(tans)


def vjp_embeds(lib, spec: Spec, model, es, cts):
    def one(e, ct):
        out, fn = lib.vjp(lambda e: spec.from_embeds(model, e), e)
        return out, fn(ct)[0]
    return lib.vmap(one)(es, cts)


def loop_vjp_embeds(spec: Spec, model, es, cts):
    outs, grads = [], []
    for e, ct in zip(es, cts):
        e = e.detach().requires_grad_()
        o = spec.from_embeds(model, e)
        grads.append(torch.autograd.grad(o, e, ct)[0])
        outs.append(o.detach())
    return torch.stack(outs), torch.stack(grads)


def embeds_and_directions(spec: Spec, model, xs):
    """The batch's input embeddings (or pixels), and a tangent / cotangent for each."""
    es = _embeds_batch(spec, model, xs)
    g = torch.Generator().manual_seed(7)
    ts = torch.randn(es.shape, generator=g)
    with torch.no_grad():
        out_shape = spec.from_embeds(model, es[0]).shape
    cts = torch.randn((es.shape[0],) + tuple(out_shape), generator=g)
    return es, ts, cts


# Second order and forward mode at one example: ``e`` is one example's embeddings / pixels.

def _small_logits(spec: Spec, model):
    def logits(e):                      # a small output: the logits summed over positions
        out = spec.from_embeds(model, e)
        return out.sum(0) if out.dim() > 1 else out
    return logits


def _energy(spec: Spec, model):
    def energy(e):
        return (spec.from_embeds(model, e) ** 2).sum()
    return energy


def jacfwd_logits(lib, spec: Spec, model, e):
    return lib.jacfwd(_small_logits(spec, model))(e)


def hessian_energy(lib, spec: Spec, model, e):
    return lib.hessian(_energy(spec, model))(e)


def _math_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.MATH])


def loop_jacobian_logits(spec: Spec, model, e):
    """Plain reverse mode, one output element at a time."""
    e = e.detach().requires_grad_()
    out = _small_logits(spec, model)(e)
    rows = [torch.autograd.grad(o, e, retain_graph=True)[0] for o in out.reshape(-1)]
    return torch.stack(rows).reshape(*out.shape, *e.shape)


def loop_hessian_energy(spec: Spec, model, e, directions=None):
    """Plain double backward, attention on its math kernel (the fused CPU kernel's backward has
    no derivative in PyTorch): the Hessian row by row, or its products with ``directions``
    (a few random directions check a large Hessian at a fraction of the cost)."""
    e = e.detach().requires_grad_()
    with _math_attention():
        g = torch.autograd.grad(_energy(spec, model)(e), e, create_graph=True)[0]
        if directions is not None:
            return torch.stack([torch.autograd.grad(g, e, d, retain_graph=True)[0]
                                for d in directions])
        rows = [torch.autograd.grad(gi, e, retain_graph=True)[0] for gi in g.reshape(-1)]
    return torch.stack(rows).reshape(*e.shape, *e.shape)
