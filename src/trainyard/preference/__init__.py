"""Preference tuning (train.objective dpo): the pairwise losses over packed pairs (loss.py) and full fine-tuning's
reference log-probabilities, computed once before training (reference.py). The data side is data/preference.py."""
