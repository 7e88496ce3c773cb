"""attnuq.metrics"""
