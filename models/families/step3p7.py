"""Step-3.7: 1-axis RoPE; each image expands to <im_start> <im_patch>... <im_end> (and local
crops between <patch_start> / <patch_end>). Its checkpoints carry MTP layers
(`num_nextn_predict_layers`), which `--drafter mtp` drafts with (engine/drafters/mtp.py)."""

from .base import Family

STEP3P7 = Family("step3p7", ("step3p7",))
FAMILIES = (STEP3P7,)
