"""What hfcp reads from a model instead of retyping it per family (docs/reference/family-records.md).

- which modules compute attention through transformers' AttentionInterface (their forward looks the function
  up in ALL_ATTENTION_FUNCTIONS, so setting the model's attn_implementation to hfcp's key reroutes them);
- whether every decoder layer mixes tokens through such an attention module and nothing else (an SSM,
  convolution or recurrent mixer would run on a rank's shard alone), and whether any convolution over tokens sits
  outside the mixers a record makes exact (even inside an attention module);
- what the causal LM does to its logits after the output head (scale, softcap): the chunked loss intercepts the
  head, so it applies the same transform; a forward it cannot read computes its loss from the model's own logits.

Source inspection decides only what is safe: anything it cannot read is treated as unsupported or
post-processed, and the runtime checks (every patched module must call hfcp's attention each step; attention
arguments hfcp does not implement are refused) catch what it misses.
"""
from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap

import torch

from ..loss.linear_ce import LogitTransform
from ..loss.router import RouterAux, check_form

# class-name fragments of sequence mixers other than attention (state-space, convolution, recurrence, linear attention)
_OTHER_MIXERS = re.compile(r"Mamba|SSM|Mixer|ShortConv|DeltaNet|LinearAttention|Recurrent|RGLRU|"
                           r"Retention|Rwkv|TimeMix|Hyena|Lightning")
_PER_TOKEN = re.compile(r"Norm$")  # such names of those families are per-token norms (Mamba2RMSNorm)


@functools.lru_cache(maxsize=None)
def _source(cls) -> str | None:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


def uses_attention_interface(module: torch.nn.Module) -> bool:
    """Whether the module's forward gets its attention function from transformers' AttentionInterface."""
    src = _source(type(module))
    return src is not None and "ALL_ATTENTION_FUNCTIONS" in src


def interface_attention_classes(model: torch.nn.Module) -> tuple[str, ...]:
    """Class names of the modules of `model` that compute attention through the AttentionInterface."""
    return tuple(sorted({type(m).__name__ for m in model.modules() if uses_attention_interface(m)}))


def not_through_interface(model, attention_classes: tuple[str, ...]) -> str | None:
    """Why the modules of `attention_classes` cannot be rerouted to hfcp's attention, or None: each named class must
    exist in the model and compute attention through transformers' AttentionInterface (a module that computes
    attention itself would attend within its rank's shard only)."""
    found = {type(m).__name__: m for m in model.modules() if type(m).__name__ in attention_classes}
    missing = [c for c in attention_classes if c not in found]
    if missing:
        return f"its record names attention classes {missing} that {type(model).__name__} does not have"
    own = [c for c, m in found.items() if not uses_attention_interface(m)]
    if not own:
        return None
    inside = sorted({type(c).__name__ for c in found[own[0]].modules() if uses_attention_interface(c)})
    hint = f" ({', '.join(inside)}, inside it, does: name that class)" if inside else ""
    return (f"{', '.join(own)} does not compute attention through transformers' AttentionInterface{hint}, so hfcp "
            "cannot reroute it")


def decoder_layers(model, num_layers: int) -> list[torch.nn.Module] | None:
    """The first ModuleList of `num_layers` modules (the decoder layers), or None."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    return list(lists[0]) if lists else None


def other_mixers(model, attention_classes: tuple[str, ...], handled: tuple[str, ...] = (),
                 token_wise: tuple[str, ...] = ()) -> str | None:
    """Why `model` cannot be made exact by rerouting attention alone, or None.

    Every decoder layer must hold an attention module of `attention_classes` or a mixer of `handled` (classes its
    record makes exact), or have only children of `token_wise` classes (its record knows they compute each token
    alone) and norms; no module outside them may be a sequence mixer of another kind.
    """
    cfg = model.config.get_text_config()
    n = getattr(cfg, "num_hidden_layers", None)
    layers = decoder_layers(model, n) if isinstance(n, int) and n > 0 else None
    if layers is None:
        return f"hfcp found no list of {n} decoder layers in {type(model).__name__}"
    for i, layer in enumerate(layers):
        children = [type(c).__name__ for c in layer.children()]
        if any(c in token_wise for c in children) and all(c in token_wise or _PER_TOKEN.search(c) for c in children):
            continue  # Nemotron-H's MLP and MoE layers
        if not any(type(m).__name__ in attention_classes + handled for m in layer.modules()):
            kinds = sorted({type(c).__name__ for c in layer.children()})
            return (f"decoder layer {i} ({type(layer).__name__}: {', '.join(kinds)}) mixes tokens without attention "
                    "through transformers' AttentionInterface, so under CP it would see only its rank's shard")
    ids = {id(layer) for layer in layers}
    known = attention_classes + handled
    # the layers and the modules above them, and the modules above a known mixer (Zamba's mamba_decoder, a decoder
    # layer of its own inside the hybrid layer): their token mixing is that of the modules checked here
    holders = {name[:i] for name, m in model.named_modules() if id(m) in ids or type(m).__name__ in known
               for i in [0, len(name)] + [j for j, c in enumerate(name) if c == "."]}
    for name, m in model.named_modules():
        if "position_ids_from_input_ids" in (_source(type(m)) or ""):
            return (f"{name or 'the model'} ({type(m).__name__}) computes position ids from input_ids (RoBERTa-style, "
                    "offset by the padding index), which hfcp does not reproduce")
        if type(m).__name__ in known + token_wise or name in holders:
            continue  # the layers are checked above, whatever their names or their models' say (Mamba2ForCausalLM)
        if (_OTHER_MIXERS.search(type(m).__name__) and not _PER_TOKEN.search(type(m).__name__)
                and not _inside_attention(model, name, known)):
            return (f"{name} ({type(m).__name__}) is a sequence mixer other than attention; under CP it would see "
                    "only its rank's shard")
    return None


def token_convolution(model, exempt: tuple[str, ...] = ()) -> str | None:
    """Why `model` mixes tokens through a convolution that would see only its rank's shard, or None.

    A convolution whose kernel spans more than one position (nn.Conv1d/2d/3d, kernel_size > 1 along any axis) mixes
    neighbouring tokens wherever it sits, even inside an attention module (a convolution over the projected queries
    and keys), and no attention function sees it. Refused unless it lies inside a module of `exempt`: a mixer its
    record makes exact (Mamba's causal convolution with its halo) or the embeddings of a token model, which run on the
    whole input before hfcp shards their output (a vision patch embedding).
    """
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.modules.conv._ConvNd) or all(k == 1 for k in m.kernel_size):
            continue
        # the classes of the modules that hold it, outermost first (the model itself first)
        owners = [type(model.get_submodule(".".join(name.split(".")[:k]))).__name__ for k in range(name.count(".") + 1)]
        if any(o in exempt for o in owners + [type(m).__name__]):
            continue
        inside = f" inside {owners[-1]}" if len(owners) > 1 else ""
        return (f"{name} ({type(m).__name__}, kernel_size={tuple(m.kernel_size)}){inside} convolves over neighbouring "
                "tokens outside transformers' AttentionInterface, so under CP it would see only its rank's shard (and "
                "miss the tokens before it on the previous rank)")
    return None


def _inside_attention(model, name: str, attention_classes) -> bool:
    parts = name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        if type(model.get_submodule(".".join(parts[:k]))).__name__ in attention_classes:
            return True
    return False


def logit_transform(model) -> LogitTransform | None:
    """What the causal LM's forward does to its logits after the output head, as a LogitTransform (IDENTITY when
    nothing), or None when it cannot be read: then the chunked loss, which replaces the head's output, would skip
    it, and the model computes its loss from its own logits instead.

    Read from the forward's syntax tree: `logits` is assigned once from a bare call of the head, then only by
    statements of the forms `logits = logits * X`, `logits / X`, `torch.tanh(logits)` (optionally inside
    `if X is not None:`), where X is a number or an attribute of the model (`self.logit_scale`,
    `self.config.final_logit_softcapping`) read now.
    """
    src = _source(type(model))
    head = model.get_output_embeddings()
    name = next((n for n, c in model.named_children() if c is head), None)
    if src is None or name is None:
        return None
    try:
        body = ast.parse(textwrap.dedent(src)).body[0].body
    except (SyntaxError, IndexError, AttributeError):
        return None
    head_calls = [n for n in ast.walk(ast.Module(body=body, type_ignores=[])) if isinstance(n, ast.Call)
                  and isinstance(n.func, ast.Attribute) and n.func.attr == name and isinstance(n.func.value, ast.Name)
                  and n.func.value.id == "self"]
    at = next((i for i, st in enumerate(body) if isinstance(st, ast.Assign) and len(head_calls) == 1
               and st.value is head_calls[0] and [_name(t) for t in st.targets] == ["logits"]), None)
    if at is None or any(_writes_logits(st) for st in body[:at]) or _mutates_logits(body):
        return None
    ops = []
    for st in body[at + 1:]:
        if not _writes_logits(st):
            continue
        if isinstance(st, ast.If) and _is_not_none(st.test) and not st.orelse:
            guard = _value(model, st.test.left)
            if guard is _UNREAD:
                return None
            stmts = st.body if guard is not None else []
        else:
            stmts = [st]
        for inner in stmts:
            op = _logit_op(model, inner)
            if op is None:
                return None
            ops.append(op)
    return _compose(ops)


_UNREAD = object()


def _name(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _writes_logits(node) -> bool:
    return any(isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and "logits" in map(_name, _targets(n))
               for n in ast.walk(node))


def _mutates_logits(body) -> bool:
    """Whether any statement changes `logits` in place: `logits[...] = x`, `logits.mul_(...)`, `out=logits`."""
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
                isinstance(t, (ast.Subscript, ast.Attribute)) and _root_name(t) == "logits" for t in _targets(node)):
            return True
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute) and node.func.attr.endswith("_") and \
                    _root_name(node.func.value) == "logits":
                return True
            if any(k.arg == "out" and _root_name(k.value) == "logits" for k in node.keywords):
                return True
    return False


def _root_name(node) -> str | None:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return _name(node)


def _is_not_none(test) -> bool:
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None)


def _value(model, node):
    """A number or None from a constant or a `self.a.b` chain read on `model`; _UNREAD for anything else."""
    if isinstance(node, ast.Constant):
        value = node.value
    else:
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if _name(node) != "self" or not chain:
            return _UNREAD
        value = model
        for attr in reversed(chain):
            value = getattr(value, attr, _UNREAD)
            if value is _UNREAD:
                return _UNREAD
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    return _UNREAD


def _is_logits(node) -> bool:
    """`logits` or `logits.float()`."""
    if isinstance(node, ast.Call) and not node.args and not node.keywords and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "float":
        node = node.func.value
    return _name(node) == "logits"


def _logit_op(model, st):
    """("mul", x) / ("tanh", None) for one statement `logits = ...`, or None when it is not of a known form."""
    if not (isinstance(st, ast.Assign) and [_name(t) for t in st.targets] == ["logits"]):
        return None
    v = st.value
    if isinstance(v, ast.BinOp) and isinstance(v.op, (ast.Mult, ast.Div)):
        if _is_logits(v.left):
            x = _value(model, v.right)
        elif isinstance(v.op, ast.Mult) and _is_logits(v.right):
            x = _value(model, v.left)
        else:
            return None
        if x is _UNREAD or x is None or x == 0:
            return None
        return ("mul", float(x) if isinstance(v.op, ast.Mult) else 1.0 / float(x))
    if isinstance(v, ast.Call) and len(v.args) == 1 and not v.keywords and _is_logits(v.args[0]) \
            and isinstance(v.func, ast.Attribute) and v.func.attr == "tanh":
        return ("tanh", None)
    return None


def _compose(ops) -> LogitTransform | None:
    scale, out_scale, tanh = 1.0, 1.0, False
    for kind, x in ops:
        if kind == "tanh":
            if tanh:
                return None
            tanh = True
        elif tanh:
            out_scale *= x
        else:
            scale *= x
    return LogitTransform(scale, tanh, out_scale) if tanh else LogitTransform(scale)


def _targets(node) -> list:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    out = []
    for t in targets:
        out += list(t.elts) if isinstance(t, ast.Tuple) else [t]
    return out


def router_aux_loss(model):
    """How the causal LM's forward adds the MoE router load-balancing loss, read from its syntax tree:
    RouterAux(num_experts, top_k, coef) for `aux = load_balancing_loss_func(outputs.router_logits, E, K, mask)` and
    `loss += C * aux...` with E, K, C numbers or attributes of the model, checked to compute the formula hfcp
    implements (loss.router.check_form); None when the forward computes no such loss; a str saying why hfcp
    cannot compute it otherwise."""
    src = _source(type(model))
    if src is None or "load_balancing_loss_func" not in src:
        return None
    why = f"{type(model).__name__}'s router auxiliary loss is computed in a form hfcp does not read"
    calls = [n for n in ast.walk(ast.parse(textwrap.dedent(src))) if isinstance(n, ast.Call)
             and _name(n.func) == "load_balancing_loss_func"]
    adds = [n for n in ast.walk(ast.parse(textwrap.dedent(src))) if isinstance(n, ast.AugAssign)
            and _name(n.target) == "loss" and isinstance(n.op, ast.Add) and isinstance(n.value, ast.BinOp)
            and isinstance(n.value.op, ast.Mult)]
    if len(calls) != 1 or len(calls[0].args) != 4 or calls[0].keywords or len(adds) != 1 \
            or _name(calls[0].args[3]) != "attention_mask":  # hfcp weights by the attention mask (and its padding)
        return why
    num_experts, top_k = (_value(model, a) for a in calls[0].args[1:3])
    coef = _value(model, adds[0].value.left)
    if any(not isinstance(x, (int, float)) for x in (num_experts, top_k, coef)) or num_experts != int(num_experts) \
            or top_k != int(top_k):
        return why
    aux = RouterAux(int(num_experts), int(top_k), float(coef))
    fn = inspect.unwrap(type(model).forward).__globals__.get("load_balancing_loss_func")
    if fn is None or not check_form(fn, aux):
        return (f"{type(model).__name__}'s load_balancing_loss_func is not the Switch-Transformer form hfcp computes "
                "from whole-sequence statistics")
    return aux
