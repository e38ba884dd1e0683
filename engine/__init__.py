"""pdserve.engine"""
