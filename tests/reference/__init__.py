"""Slow, obviously-correct pure-Python references used as test oracles.

kv_cells_ref: llama.cpp's KV-cache cell bookkeeping (llama_kv_cells, find_slot,
apply_ubatch, prepare, the seq_* operations) on plain lists, sets and Counters.
"""
