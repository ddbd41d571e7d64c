"""Sequence classifiers with a forward of their own that pools exactly as transformers' generic one: `self.score` over
the last hidden states, then the scores at each row's last token that is not config.pad_token_id (the last token
without one, or with inputs_embeds), and the loss from those pooled scores. hfcp pools them over the whole sequence
(hfcp/hooks/heads.py); each forward is fingerprinted, so another version of its code is refused."""
from hfcp.families.heads import register_sequence_head

from .verified import TRANSFORMERS_VERSION

FINGERPRINTS = {  # hfcp.families.source_guard.fingerprints_of(cls, ["forward"]), transformers 5.24.0
    "GPT2ForSequenceClassification.forward": "9b4d38cda8049820",  # gpt2, gpt-sw3
    "GPTNeoXForSequenceClassification.forward": "f4728f00bd252e3c",
    "OPTForSequenceClassification.forward": "0dad60ef2d50b9c9",
    "GPTBigCodeForSequenceClassification.forward": "0b7a4b4b3ecd8001",
}

for key, fingerprint in FINGERPRINTS.items():
    register_sequence_head(key.partition(".")[0], "score", {key: fingerprint}, TRANSFORMERS_VERSION)
