"""engine/reference"""
