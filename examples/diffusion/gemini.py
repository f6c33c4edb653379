# Gemini over the data ranks: model state placed from the warm-up trace, the frozen encoders'
# shards in host memory between uses (examples/diffusion/train_unet.py; docs/diffusion.md)
gemini = dict(placement="auto", frozen_tier="host")
