"""trainyard: one YAML-described LLM training job, from a CPU to many nodes."""

import logging

__version__ = "0.1.0"

# Where torchao is installed (model.quantize, fp8), transformers imports it with PEFT in every job, and its import
# logs each optional CUDA kernel this machine cannot load and a torch deprecation of its own: none of them the
# user's to act on, printed before the job's first line. Its errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
