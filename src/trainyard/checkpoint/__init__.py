"""Checkpoints: lite (PEFT adapter) and full (DCP) saves, async, committed by a marker written last (`save`); the
on-disk layout (`layout`); a committed checkpoint as an HF/PEFT folder (`export`) or evaluated (`evaluate`). Never
decides when to save (train/state.py does)."""
