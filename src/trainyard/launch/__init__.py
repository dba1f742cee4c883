"""Taking a job to its processes: torchrun command building and self re-exec (`local`, `torchrun`), Slurm scripts
and Kubernetes manifests. Owns how processes start and stop; never imports the training loop, models or data."""
