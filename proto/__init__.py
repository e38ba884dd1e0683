"""pdserve.proto"""
