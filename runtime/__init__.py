"""stagewise.runtime"""
