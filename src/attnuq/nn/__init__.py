"""attnuq.nn"""
