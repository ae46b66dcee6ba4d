"""The GPU proof kit's sections (run by ``benchmarks/gpu_check.py``, ``lorapool bench gpu``)."""
