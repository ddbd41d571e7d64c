"""Balanced layouts on a DistPool: what hfcp.balance_report reads from a patched model."""
from __future__ import annotations

import torch

import hfcp
from workers_model import tiny_model


def report_of_patched(strategy: str, balance: str = "auto", model_type: str = "mistral") -> tuple[dict, dict]:
    """(report of the patched model, report of the same model unpatched with cp_size = the world)."""
    model = tiny_model(model_type)
    pos = torch.cat([torch.arange(n) for n in (40, 6, 9, 17)])[None]
    ids = torch.randint(0, 64, pos.shape, generator=torch.Generator().manual_seed(0))
    before = hfcp.balance_report(model, cp_size=torch.distributed.get_world_size(), input_ids=ids, position_ids=pos)
    hfcp.patch(model, strategy=strategy, balance=balance)
    try:
        return hfcp.balance_report(model, input_ids=ids, position_ids=pos), before
    finally:
        hfcp.unpatch(model)


def family_exact(model_type: str, strategy: str, documents: list[list[int]], balance: str = "auto") -> dict:
    """Patched (balance="auto") vs unpatched on packed rows of these documents, for a family of hfcp's tiny models
    (Gemma 2: softcaps and sliding windows): loss, gathered logits, every
    gradient (averaged over the group), and whether the balanced layout ran."""
    import torch.distributed as dist

    from hfcp.testing.compare import grad_error
    from hfcp.testing.tiny import tiny_model as hfcp_tiny

    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
    ids = torch.randint(3, 96, pos.shape, generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :2] = -100
    data = {"input_ids": ids, "labels": labels, "position_ids": pos}
    ref, model = hfcp_tiny(model_type), hfcp_tiny(model_type)
    want = ref(**data, use_cache=False)
    want.loss.backward()
    hfcp.patch(model, strategy=strategy, loss_chunk=None, balance=balance)
    try:
        got = model(**data)
        got.loss.backward()
        logits = hfcp.gather_sequence(got.logits, model)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        for g in grads.values():
            dist.all_reduce(g)
            g /= dist.get_world_size()
        return {"loss": abs(got.loss.item() - want.loss.item()) / abs(want.loss.item()),
                "logits": float((logits - want.logits).detach().abs().max() / want.logits.detach().abs().max()),
                "grad": grad_error(grads, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}),
                "balanced": hfcp.cp_state(model).step.layout.balanced}
    finally:
        hfcp.unpatch(model)


class LongTailRows(torch.utils.data.Dataset):
    """n packed rows of 64 tokens (input_ids, position_ids, labels): one document of 40 tokens and six short ones, in
    another order in each row."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.tensor([40, 6, 5, 4, 3, 3, 3])
        self.rows = []
        for _ in range(n):
            pos = torch.cat([torch.arange(int(k)) for k in lengths[torch.randperm(len(lengths), generator=g)]])
            ids = torch.randint(0, 64, pos.shape, generator=g)
            self.rows.append({"input_ids": ids, "position_ids": pos, "labels": ids.clone()})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def trainer_imbalance_run(balance: str) -> dict:
    """HfcpTrainer(balance=balance), 4 steps of one long-tail packed row, logged every 2 steps: the
    logged (step, cp_imbalance) pairs, the batches of the training forwards (input_ids, position_ids), and how many
    times the work per query was counted (hfcp.layout.work.query_work)."""
    import tempfile

    from hfcp.layout import work
    from hfcp.integrations import HfcpTrainer
    from workers_trainer import _args, _reset_accelerate

    _reset_accelerate()
    model = tiny_model("llama")
    batches = []
    model.register_forward_pre_hook(lambda m, args, kw: batches.append((kw["input_ids"].clone(),
                                                                        kw["position_ids"].clone()))
                                    if m.training else None, with_kwargs=True)
    counted, count = [], work.query_work
    work.query_work = lambda *a: counted.append(1) or count(*a)  # the work counts of the run (one mask: one a step)
    try:
        with tempfile.TemporaryDirectory() as out:
            trainer = HfcpTrainer(model=model, args=_args(out, 1, logging_steps=2), train_dataset=LongTailRows(8),
                                  balance=balance)  # (hfcp.patch's option, passed by the trainer)
            trainer.train()
    finally:
        work.query_work = count
    logged = [(h["step"], h["cp_imbalance"]) for h in trainer.state.log_history if "cp_imbalance" in h]
    return {"logged": logged, "losses": sum("loss" in h for h in trainer.state.log_history), "batches": batches,
            "work_counts": len(counted)}


def assert_imbalance_logged(runs: list[dict], reference: dict) -> None:
    """The ranks of a CP run logged cp_imbalance (at least 1, the same on every rank) with each training loss; the
    one-process reference none. runs / reference: workers' results with "imbalance", the value of each loss's log."""
    assert reference["imbalance"] and set(reference["imbalance"]) == {None}, reference["imbalance"]
    for got in runs:
        assert got["imbalance"] == runs[0]["imbalance"], [g["imbalance"] for g in runs]
        assert len(got["imbalance"]) == len(reference["imbalance"]), (got["imbalance"], reference["imbalance"])
        assert all(v is not None and v >= 1.0 for v in got["imbalance"]), got["imbalance"]


def sequence_outputs_exact(documents: list[list[int]]) -> dict:
    """What reads a packed row's tokens where the balanced layout put them, patched vs unpatched (relative errors,
    every gradient averaged over the group): a sequence classifier's pooled logits (each row's last non-pad token, a
    pad in the middle and at the tail), logits_to_keep=3, hfcp.sequence_logps' row sums, gathered hidden states;
    and whether each forward ran the balanced layout."""
    import torch.distributed as dist

    from hfcp.testing.compare import grad_error
    from hfcp.testing.tiny import tiny_model as hfcp_tiny

    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
    ids = torch.randint(3, 96, pos.shape, generator=torch.Generator().manual_seed(3))
    padded = ids.clone()
    padded[0, -3:], padded[1, 7] = 0, 0  # the classifier's pad_token_id

    def rel(a, b):
        return float((a - b).detach().abs().max() / b.detach().abs().max())

    def run(model, patched):
        score = model(input_ids=padded, position_ids=pos, labels=torch.tensor([1, 0]))
        return score.loss, score.logits

    def logps(model, patched):
        out = hfcp.sequence_logps(model, ids, position_ids=pos)
        kept = model(input_ids=ids, position_ids=pos, logits_to_keep=3, output_hidden_states=True).logits
        hidden = model(input_ids=ids, position_ids=pos, output_hidden_states=True).hidden_states[-1]
        return (out.sums * torch.tensor([1.0, -2.0])).sum(), (
            out.sums, kept, hfcp.gather_sequence(hidden, model) if patched else hidden)

    errors = {}
    for name, head, call in (("classifier", "sequence-classification", run), ("causal lm", None, logps)):
        ref, model = hfcp_tiny("llama", head=head).eval(), hfcp_tiny("llama", head=head).eval()  # eval: no dropout
        loss, want = call(ref, False)
        loss.backward()
        hfcp.patch(model)
        try:
            got_loss, got = call(model, True)
            got_loss.backward()
            errors[f"{name} balanced"] = hfcp.cp_state(model).step.layout.balanced
        finally:
            hfcp.unpatch(model)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        for g in grads.values():
            dist.all_reduce(g)
            g /= dist.get_world_size()
        errors[f"{name} loss"] = rel(got_loss, loss)
        errors[f"{name} outputs"] = max(rel(g, w) for g, w in zip(got if isinstance(got, tuple) else (got,),
                                                                   want if isinstance(want, tuple) else (want,)))
        errors[f"{name} grad"] = grad_error(grads, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None})
    return errors
