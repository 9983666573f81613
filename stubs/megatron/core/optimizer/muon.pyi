# megatron-core 0.16 keeps Muon here; 0.19 leaves a shim and moves it to emerging_optimizers.
import torch

class TensorParallelMuon(torch.optim.Optimizer): ...
