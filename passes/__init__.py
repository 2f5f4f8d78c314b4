"""stagewise.passes"""
