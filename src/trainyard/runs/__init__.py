"""A run read from its run directory alone, from any machine: progress and silent ranks (`status`), plots and a
summary (`report`), hang localisation from flight records (`diagnose`). Never imports torch.distributed, models
or training."""
