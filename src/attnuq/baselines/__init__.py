"""attnuq.baselines"""
