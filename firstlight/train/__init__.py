"""Training recipes: Medusa heads by self-distillation (heads.py), data-parallel over torch.distributed."""
