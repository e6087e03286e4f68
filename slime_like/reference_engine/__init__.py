"""The reference engine: an SGLang 0.5.23-protocol server over a small torch model.

Start it as `python -m slime_like.reference_engine --model-path DIR --port P`. It imports
neither Ray nor sglang, so it runs on CPU boxes and bare GPU machines alike.
"""
