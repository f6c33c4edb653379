# ZeRO-3 over the data ranks: the UNet's weights, gradients and AdamW states sharded, the frozen
# encoders' weights sharded and gathered for each use (examples/diffusion/train_unet.py)
zero = dict(stage=3)
