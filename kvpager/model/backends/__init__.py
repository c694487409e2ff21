"""Execution backends for the model's ops: torch reference ops and the CPU C++ kernels."""
