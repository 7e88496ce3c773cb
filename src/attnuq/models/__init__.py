"""attnuq.models"""
