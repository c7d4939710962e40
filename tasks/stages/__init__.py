"""The stages: one module per stage, named as its stage.
"""
