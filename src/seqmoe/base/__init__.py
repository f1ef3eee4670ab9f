"""PLANE"""
