"""stagewise.compiler"""
