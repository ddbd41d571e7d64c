"""What hfcp reads from a causal LM's forward source instead of retyping it per family:
- what it does to its logits after the output head (scale, softcap): the chunked loss intercepts the head, so it
  applies the same transform; a forward it cannot read computes its loss from the model's own logits;
- how it adds the MoE router load-balancing loss, which hfcp computes from whole-sequence statistics.
Anything it cannot read is treated as not read (the safe side), never guessed.
"""
from __future__ import annotations

import ast
import inspect
import textwrap

from ..loss.linear_ce import LogitTransform
from ..loss.router import RouterAux, check_form
from .introspect import _source


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
