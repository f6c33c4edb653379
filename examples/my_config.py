# my_config.py
mixed_precision = dict(dtype="bf16")
gradient_accumulation = 2
clip_grad_norm = 1.0
