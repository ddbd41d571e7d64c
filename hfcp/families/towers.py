"""Which vision towers and audio encoders encode each image or clip alone (so that hfcp may split their items over
the CP group), filled by patches/ (model knowledge); the split itself is hfcp/hooks/tower_split.py."""
from __future__ import annotations


# encoder configs' model_types whose towers encode each image / clip on its own (filled by patches/: model
# knowledge), with how their inputs hold the items: "items" along dim 0 (or Qwen-VL grids), "frames" (Qwen-VL
# grids split into temporal frames), "clips" (audio clips along dim 0 only), "time" (audio clips concatenated along
# the last dim, lengths in feature_lens).
# A record with vision_tower / audio_tower "auto" splits only these, and runs any other tower whole on every rank
_SPLIT_MODES: dict[str, str] = {}
# those of them whose batch norms normalise over every clip of a call: hfcp sums their statistics over the CP group
_SYNCED_BATCH_NORMS: set[str] = set()


def register_per_image_tower(model_type: str, frames_alone: bool = False) -> None:
    """Declare that vision towers of config model_type `model_type` encode each image (or Qwen-VL grid) alone, so
    that hfcp may split their images over the CP group; frames_alone: a patch-sequence tower whose output for a
    grid (t, h, w) is that of its t frames (1, h, w) encoded one by one, so that a video's frames are split too."""
    _SPLIT_MODES[model_type] = "frames" if frames_alone else "items"


def register_per_clip_encoder(model_type: str, clips_in_time: bool = False, batch_norm: bool = False) -> None:
    """Declare that audio encoders of config model_type `model_type` encode each clip alone (attention, convolution
    and normalisation within a clip), so that hfcp may split their clips over the CP group; clips_in_time: the
    encoder takes every clip's frames concatenated along its input's last dim with one `feature_lens` entry per clip
    and returns rows per clip in clip order (Qwen2.5-Omni's); else clips along dim 0. batch_norm: all but its batch
    norms, whose training statistics are over every clip of the call (Granite Speech's Conformer): hfcp sums them
    over the CP group (hfcp/hooks/synced_batch_norm.py); clips along dim 0 only.

    Raises:
        ValueError: batch_norm with clips_in_time (a batch norm over concatenated clips is not implemented).
    """
    if batch_norm and clips_in_time:
        raise ValueError(f"register_per_clip_encoder({model_type!r}): batch_norm=True is implemented for clips along "
                         "dim 0, not clips_in_time")
    _SPLIT_MODES[model_type] = "time" if clips_in_time else "clips"
    if batch_norm:
        _SYNCED_BATCH_NORMS.add(model_type)
    else:
        _SYNCED_BATCH_NORMS.discard(model_type)


def split_mode(config) -> str | None:
    """How hfcp splits a tower of this encoder config ("items", "frames", "clips", "time"), or None: it runs whole."""
    return _SPLIT_MODES.get(getattr(config, "model_type", None))


def syncs_batch_norm(config) -> bool:
    """Whether hfcp sums the batch norm statistics of a tower of this config over the CP group (registered with
    batch_norm=True)."""
    return getattr(config, "model_type", None) in _SYNCED_BATCH_NORMS


def splits_tower(config) -> bool:
    """Whether a tower of this vision or audio config is one hfcp splits (register_per_image_tower /
    register_per_clip_encoder)."""
    return split_mode(config) is not None


def splits_frames(vision_config) -> bool:
    """Whether hfcp splits this tower's videos by frames (register_per_image_tower(..., frames_alone=True))."""
    return split_mode(vision_config) == "frames"
