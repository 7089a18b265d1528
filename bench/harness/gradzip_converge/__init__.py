"""Convergence harness: train a model (a ViT/14 or U-Net depth model, or a small language model)
under each gradzip codec and compare accuracy against bytes on the wire. Run
``python -m gradzip_converge --suite cpu-default --out DIR``.

Modules: models (ViT/14 encoder + DPT head), conv_depth (the U-Net), char_lm (the byte-level
language model), zoo (every model by name, from torch alone), tasks (what a model learns: data, loss, evaluation, metric names), text (the
language model's text), weights (local checkpoint loading), scenes (procedural RGB-D), datasets
(NYU, KITTI, folder loaders), metrics, losses (SILog), compression (the simulated W-worker
reduction over gradzip.simulation.SimulatedWorkers), training, distributed
(real DDP under torchrun), suites, report, output (what cli and distributed share), cli. Only
compression and distributed import the compiled extension, and only when a run needs it. The
harness is a distribution of its own, gradzip-converge (bench/harness in the gradzip repository),
beside the library it measures: ``pip install ./bench/harness`` after gradzip.
"""
