"""The audio sweep: every model_type of transformers' multimodal-LM mapping whose model takes audio (an audio
encoder config beside its text config; an omni model's thinker, the part that trains, in place of the whole), a
tiny random config (text and audio parts shrunk, placeholder ids inside the tiny vocabulary), patched (cp 2, ring)
against the unpatched model, loss and every gradient, with a text-only batch and with three clips (one in row 0,
two in row 1, the second across the zigzag cut). The audio-token count of a clip is read from the model. Types
without a record are tried with the record patches/audio.py gives them (language model read from the model, the
audio encoder's clips split over the ranks where its type is registered as encoding each clip alone, else whole on
every rank). Run on every rank of a 2-process pool."""
from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

from hfcp.testing.tiny_audio import audio_batch, audio_types, text_batch, tiny_audio

from .vlms import _compare, check_multimodal


def check(model_type: str) -> dict:
    """{"type", "result", "detail", "text", "audio"}: sweep_vlms.check_multimodal with a text-only batch and three
    clips."""
    return check_multimodal(model_type, tiny_audio, {"text": text_batch, "audio": audio_batch})[0]


def sweep(types=None, progress: bool = False) -> list[dict]:
    results = []
    for t in types or audio_types():
        if progress and dist.get_rank() == 0:
            print(f"audio sweep: {t}", file=sys.stderr, flush=True)
        results.append(check(t))
    return results


if __name__ == "__main__":  # torchrun --nproc-per-node 2 hfcp/testing/sweeps/audio.py [types]
    dist.init_process_group("gloo")
    for r in sweep(sys.argv[1:] or None, progress=True):
        if dist.get_rank() == 0:
            print(r["type"], r["result"], r["detail"][:300])


def compare_mixed(model_type: str, strategy: str, side: str = "left") -> dict:
    """A text-only row beside a row of two clips, one across the zigzag cut, padded on `side`: _compare's result."""
    from hfcp.testing.tiny_audio import mixed_audio_batch

    built = tiny_audio(model_type)
    return _compare(lambda: copy.deepcopy(built), lambda m: mixed_audio_batch(m, side=side), strategy)


def compare_valid(model_type: str, strategy: str) -> dict:
    """audio_batch's three clips with 32, 20 and 12 valid frames of 32, the rest masked (clips of different lengths
    padded by the processor): _compare's result."""
    built = tiny_audio(model_type)
    return _compare(lambda: copy.deepcopy(built), lambda m: audio_batch(m, valid=[32, 20, 12]), strategy)


def compare_omni(strategy: str) -> dict:
    """Qwen2.5-Omni's thinker with images and clips in the same rows (omni_batch): _compare's result, and the patch
    rows the vision tower embedded in each call (the batch's own, the unpatched forward's, the patched one's)."""
    from hfcp.testing.tiny_audio import omni_batch

    built = tiny_audio("qwen2_5_omni_thinker")
    rows = []  # patch rows given to the tower's patch embedding (inside hfcp's split), call by call
    built.model.visual.patch_embed.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    result = _compare(lambda: copy.deepcopy(built), omni_batch, strategy)
    return {**result, "patch_rows": rows}


def _raised_patched(model, call) -> str:
    """What call() raised (a ValueError's message) with `model` patched over every process, or "nothing raised"."""
    import hfcp

    hfcp.patch(model, process_group=dist.group.WORLD)
    try:
        call()
    except ValueError as e:
        return str(e)
    finally:
        hfcp.unpatch(model)
    return "nothing raised"


def placeholder_mismatch_raised(model_type: str) -> str:
    """A batch with one audio placeholder too few for its clips' features, patched: what the forward raised (the
    model's own check, after hfcp's encoder split exchanged the features on every rank)."""
    from hfcp.testing.tiny_audio import AUDIO

    model = tiny_audio(model_type)
    data = audio_batch(model)
    first = int((data["input_ids"][0] == AUDIO).nonzero()[0])
    data["input_ids"][0, first] = 5
    return _raised_patched(model, lambda: model(**data))


def legacy_placeholders_refused() -> str:
    """Qwen2-Audio's legacy form (one placeholder per clip, expanded inside the model): what the patched forward
    raised (the unpatched one runs)."""
    from hfcp.testing.tiny_audio import AUDIO

    model = tiny_audio("qwen2_audio")
    data = audio_batch(model)
    ids = data["input_ids"]
    for row in range(ids.shape[0]):  # each run of placeholders becomes one placeholder followed by text
        run = (ids[row] == AUDIO) & torch.cat([torch.tensor([True]), ids[row, :-1] != AUDIO])
        ids[row] = torch.where((ids[row] == AUDIO) & ~run, 5, ids[row])
    data.pop("labels")  # (transformers' legacy path fails with labels: its config has no ignore_index)
    model(**data, use_cache=False)  # transformers' own legacy expansion runs
    return _raised_patched(model, lambda: model(**data))


def generate_after_clips(model_type: str, lora: bool = False) -> str:
    """Greedy generate() after an audio prompt (three clips, two rows), patched against unpatched: "same tokens",
    "different tokens" or the ValueError's message; lora: both under a PEFT LoRA wrapper (its generate() swaps the
    model's prepare_inputs_for_generation itself)."""
    import hfcp

    ref = tiny_audio(model_type).eval()
    data = audio_batch(ref)
    if lora:
        from peft import LoraConfig, get_peft_model

        ref = get_peft_model(ref, LoraConfig(r=4, init_lora_weights=False, task_type="CAUSAL_LM",
                                             target_modules=r".*language_model.*q_proj"))
    model = copy.deepcopy(ref)
    data.pop("labels")
    want = ref.generate(**data, max_new_tokens=6, do_sample=False)
    hfcp.patch(model, process_group=dist.group.WORLD)
    try:
        got = model.generate(**data, max_new_tokens=6, do_sample=False)
    except ValueError as e:
        return str(e)
    finally:
        hfcp.unpatch(model)
    return "same tokens" if torch.equal(got, want) else "different tokens"


def generate_with_cache_after_clips(model_type: str) -> tuple[bool, int]:
    """generate_after_clips with use_cache=True (hfcp's sharded cache; the tiny configs have it off): (the unpatched
    model's tokens, how many times the patched model's audio encoder ran)."""
    import hfcp
    from hfcp.families.introspect import audio_config
    from hfcp.families.introspect import module_with_config

    ref = tiny_audio(model_type).eval()
    model = copy.deepcopy(ref)
    data = audio_batch(ref)
    data.pop("labels")
    calls = []
    model.get_submodule(module_with_config(model, audio_config(model.config))).register_forward_pre_hook(
        lambda module, args: calls.append(1))
    want = ref.generate(**data, max_new_tokens=6, do_sample=False, use_cache=True)
    hfcp.patch(model, process_group=dist.group.WORLD)
    try:
        got = model.generate(**data, max_new_tokens=6, do_sample=False, use_cache=True)
    finally:
        hfcp.unpatch(model)
    return torch.equal(got, want), len(calls)


def encoder_shares(model_type: str) -> list[int]:
    """The clips (indices into the batch's three) that this rank's audio encoder was given in a patched forward,
    found by matching its input to each clip's frames."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    import hfcp
    from hfcp.families.introspect import audio_config
    from hfcp.families.introspect import module_with_config

    model = tiny_audio(model_type)
    data = audio_batch(model)
    encoder = model.get_submodule(module_with_config(model, audio_config(model.config)))
    seen = []

    class Seen(ModelHook):  # chained after hfcp's split: what the encoder's forward itself gets
        def pre_forward(self, module, *args, **kwargs):
            seen.append(args[0] if args else kwargs["input_features"])
            return args, kwargs

    hfcp.patch(model, process_group=dist.group.WORLD)
    add_hook_to_module(encoder, Seen(), append=True)
    try:
        model(**data)
    finally:
        hfcp.unpatch(model)
    feats, = seen
    clips = list(data["input_features"])  # each (mel, frames) or (frames, features)
    pieces = feats.split(clips[0].shape[-1], -1) if feats.dim() == 2 else list(feats)  # (mel, frames of all clips)
    return [next(i for i, clip in enumerate(clips) if torch.equal(clip, piece)) for piece in pieces]


def batch_norm_encoder_refused() -> str:
    """Granite Speech's Conformer (BatchNorm1d) registered as encoding each clip alone, without batch_norm=True (as a
    user's record might): what hfcp.patch raised."""
    import hfcp
    from hfcp.families import towers

    model = tiny_audio("granite_speech")
    towers.register_per_clip_encoder("granite_speech_encoder")
    try:
        hfcp.patch(model, process_group=dist.group.WORLD)
    except hfcp.UnsupportedModelError as e:
        return str(e)
    finally:
        towers.register_per_clip_encoder("granite_speech_encoder", batch_norm=True)  # (patches/audio.py's)
        hfcp.unpatch(model)
    return "nothing raised"


def cached_forward_raised(model_type: str) -> str:
    """A forward with use_cache=True (not generate()) on the patched model: what it raised."""
    model = tiny_audio(model_type).eval()
    data = audio_batch(model)
    data.pop("labels")
    return _raised_patched(model, lambda: model(**data, use_cache=True))


def encoder_called_alone(model_type: str) -> float:
    """The audio encoder called by itself with its second input positional, as its signature allows (Fun-ASR-Nano:
    the frame mask, clip 1's last frames masked; Qwen2.5-Omni: feature_lens, clips of 32, 20 and 12 frames
    concatenated in time), with output_hidden_states=True, patched against unpatched: the largest difference of its
    output and of every layer's hidden states (Qwen2.5-Omni's: rows of frames, more than the output's), and of the
    output of the encoder made to return a bare tensor."""
    import hfcp
    from hfcp.families.introspect import audio_config
    from hfcp.families.introspect import module_with_config

    model = tiny_audio(model_type)
    feats = audio_batch(model)["input_features"]
    encoder = model.get_submodule(module_with_config(model, audio_config(model.config)))
    if model_type == "qwen2_5_omni_thinker":  # (clips, mel, frames) -> (mel, valid frames of every clip)
        valid = torch.arange(feats.shape[-1])[None] < torch.tensor([[32], [20], [12]])
        feats, second = feats.transpose(1, 2)[valid].T, valid.sum(-1)
    else:
        second = torch.ones(feats.shape[:2], dtype=torch.long)
        second[1, 20:] = 0
    want = encoder(feats, second, output_hidden_states=True)
    whole = encoder.forward
    hfcp.patch(model, process_group=dist.group.WORLD)
    try:
        got = encoder(feats, second, output_hidden_states=True)
        hfcp.unpatch(model)
        encoder.forward = lambda *args: whole(*args).last_hidden_state  # a tower that returns a bare tensor
        hfcp.patch(model, process_group=dist.group.WORLD)
        bare = encoder(feats, second)
    finally:
        hfcp.unpatch(model)
    pairs = list(zip((want.last_hidden_state, want.last_hidden_state, *want.hidden_states),
                     (got.last_hidden_state, bare, *got.hidden_states)))
    assert len(want.hidden_states) == len(got.hidden_states) and all(a.shape == b.shape for a, b in pairs), pairs
    return max(float((b - a).abs().max()) for a, b in pairs)


def unlike_outputs_refused() -> str:
    """Fun-ASR-Nano's encoder made to trim its output to the longest valid clip of its call (an encoder registered
    as encoding each clip alone whose output depends on the other clips), called by itself on clips of 12, 32 and
    20 valid frames: each rank's output has another length (32 and 20). What the patched call raised."""
    from hfcp.families.introspect import audio_config
    from hfcp.families.introspect import module_with_config

    model = tiny_audio("fun_asr_nano")
    data = audio_batch(model, valid=[12, 32, 20])
    encoder = model.get_submodule(module_with_config(model, audio_config(model.config)))
    whole = encoder.forward

    def trimmed(*args, **kwargs):
        out = whole(*args, **kwargs)
        out.last_hidden_state = out.last_hidden_state[:, :int(kwargs["input_features_mask"].sum(-1).max())]
        return out

    encoder.forward = trimmed  # (before hfcp's hook, which calls it)
    return _raised_patched(model, lambda: encoder(input_features=data["input_features"],
                                                  input_features_mask=data["input_features_mask"]))


def other_clips_refused(model_type: str, name: str) -> str:
    """Rank 1 of the CP group given other values of the batch's `name` (its own audio augmentation, say), shapes
    alike: what the patched forward raised."""

    model = tiny_audio(model_type)
    data = audio_batch(model, valid=[32, 20, 12] if name != "input_features" else None)
    if dist.get_rank() == 1:
        data[name] = data[name] + 0.1 if data[name].is_floating_point() else data[name].flip(0)
    return _raised_patched(model, lambda: model(**data))


def batch_norm_split(model_type: str, mixed: bool = False) -> dict:
    """Granite Speech's Conformer split with its batch norm statistics summed over the group: a training step and an
    evaluation forward, patched against unpatched: loss and every gradient (_compare's tolerances), the running
    statistics, the eval loss (running statistics), and how many clips this rank's encoder took. The batch:
    audio_batch's three clips, or (mixed) mixed_audio_batch's two beside a text-only row."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    import hfcp
    from hfcp.testing.compare import grad_error

    from hfcp.testing.tiny_audio import mixed_audio_batch

    ref = tiny_audio(model_type).train()
    data = mixed_audio_batch(ref) if mixed else audio_batch(ref)  # (reads the clips' token counts from the encoder,
    model = copy.deepcopy(ref)  # moving its running statistics: copied after)
    encoder = model.get_submodule("model.encoder")
    took = []

    class Took(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            took.append(int((args[0] if args else kwargs["input_features"]).shape[0]))
            return args, kwargs

    want = ref(**data).loss
    want.backward()
    hfcp.patch(model, process_group=dist.group.WORLD)
    add_hook_to_module(encoder, Took(), append=True)
    try:
        got = model(**data).loss
        got.backward()
        model.eval()
        ref.eval()
        eval_err = abs(model(**data).loss.item() - ref(**data).loss.item()) / ref(**data).loss.item()
    finally:
        hfcp.unpatch(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    norms = [(a, b) for a, b in zip(ref.modules(), model.modules()) if isinstance(a, torch.nn.BatchNorm1d)]
    stats_err = max(float((getattr(a, s) - getattr(b, s)).abs().max() / getattr(a, s).abs().max())
                    for a, b in norms for s in ("running_mean", "running_var"))
    return {"loss_err": abs(got.item() - want.item()) / want.item(), "grad_err": grad_error(grads, ref_grads),
            "same_keys": grads.keys() == ref_grads.keys(), "stats_err": stats_err, "norms": len(norms),
            "eval_err": eval_err, "took": took, "tracked": [int(b.num_batches_tracked) for _, b in norms][:1]}


def synced_batch_norm_bf16() -> dict:
    """hfcp's synced batch norm against torch's on the same bf16 input (channel means of 100: the statistics must be
    taken in fp32), both measured against an fp64 reference; and the output's dtype."""
    from hfcp.hooks.synced_batch_norm import synced_batch_norm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 8, 2000, generator=g) + 100).bfloat16()
    ours, theirs = torch.nn.BatchNorm1d(8), torch.nn.BatchNorm1d(8)
    want = torch.nn.functional.batch_norm(x.double(), None, None, training=True, eps=ours.eps)
    got = synced_batch_norm(ours, x, torch.ones(3, dtype=torch.bool), dist.group.WORLD)
    return {"ours": float((got.detach().double() - want).abs().max()),
            "torch": float((theirs(x).detach().double() - want).abs().max()),
            "dtype": str(got.dtype)}
