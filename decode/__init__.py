"""pdserve.decode"""
