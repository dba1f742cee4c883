"""The model as its family defines it: where it comes from (`source`: hub id, folder, GGUF, `model.config`, the one
HF-config resolver), built on the meta device (`build`), LoRA (`lora`), attention for padding-free rows
(`attention`), each rank's rows of its weights (`weights`). Never imports parallelism, the plan, the estimate,
training or checkpoints."""
