"""pdserve.kernels"""
