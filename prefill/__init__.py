"""pdserve.prefill"""
