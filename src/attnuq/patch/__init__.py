"""attnuq.patch"""
