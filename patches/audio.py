"""Audio-language and omni models whose language model reads the merged token sequence (text embeddings with the
audio features scattered in, an omni thinker's image and video features too): hfcp shards at the language model's
input exactly as for vision-language models (hfcp/hooks/vlm.py); the language model is read from the model. The
audio encoder's clips are split over the CP group where its type encodes each clip alone (PER_CLIP_ENCODERS;
hfcp/hooks/tower_split.py); any other encoder runs whole on every rank (exact; its memory does not fall with cp).
Qwen2.5-Omni's vision tower is split by frames, as Qwen2.5-VL's. Each type here is shown exact by the audio sweep
(hfcp/testing/sweeps/audio.py, tests/families/test_audio.py) with a text-only batch and with three clips."""
from hfcp.families.registry import Patcher, register_patcher
from hfcp.families.towers import register_per_clip_encoder, register_per_image_tower

# encoders whose every layer works within one clip (its 30-second window, or its chunks): the clips along dim 0
PER_CLIP_ENCODERS = ("qwen2_audio_encoder", "voxtral_encoder", "glmasr_encoder", "fun_asr_nano_encoder",
                     "moss_transcribe_diarize_audio")
for _encoder in PER_CLIP_ENCODERS:
    register_per_clip_encoder(_encoder)
# Qwen2.5-Omni's: every clip's frames concatenated in time, feature_lens per clip, attention within n_window chunks
register_per_clip_encoder("qwen2_5_omni_audio_encoder", clips_in_time=True)
# Granite Speech's Conformer: each clip alone but its BatchNorm1d, whose training statistics are over all clips (and
# their frames): split, with those statistics summed over the CP group (hfcp/hooks/synced_batch_norm.py)
for _encoder in ("granite_speech_encoder", "granite_speech_plus_encoder"):
    register_per_clip_encoder(_encoder, batch_norm=True)
# Qwen2.5-Omni's vision tower is Qwen2.5-VL's (attention, windows and positions within each temporal frame)
register_per_image_tower("qwen2_5_omni_vision_encoder", frames_alone=True)

AUDIO_TYPES = (
    "qwen2_audio",           # Whisper-style encoder, average-pooled; its processor expands each clip's placeholders
    "qwen2_5_omni_thinker",  # Qwen2.5-Omni's trainable part: audio, image and video in time-aligned 3-D RoPE
    "voxtral",               # Whisper-style encoder, frames stacked by the projector; a Llama language model
    "glmasr",                # Whisper-style encoder with rotary positions
    "granite_speech",        # Conformer encoder (block attention), Q-Former projector
    "granite_speech_plus",
    "fun_asr_nano",          # SAN-M encoder (FSMN memory) on stacked low-frame-rate features, Qwen3 language model
    "moss_transcribe_diarize",
)

for _type in AUDIO_TYPES:
    register_patcher(Patcher(model_type=_type, attention_classes=(), read_from_model=True,
                             language_model="auto", vision_tower="auto", audio_tower="auto"))
# Qwen2.5-Omni's language model (its 3-D positions come from the thinker's rope index, split with the tokens)
register_patcher(Patcher(model_type="qwen2_5_omni_text", attention_classes=(), read_from_model=True))
