"""pdserve.kvtransfer"""
