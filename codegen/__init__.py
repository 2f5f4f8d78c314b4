"""stagewise.codegen"""
