"""The bottom layer: what drafters, the feature server, the trainer and evaluation all speak.

The target as the trainer sees it (target.py, fp8.py), the feature contract between drafters and the feature
server (contract.py), packed batches (batch.py) and the run directory's file names (run_dir.py). Imports only
torch, safetensors and the standard library; every other package may import it, it imports none of them.
"""
