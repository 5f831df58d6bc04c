"""`captiond serve --workers N`: the supervisor in the main process (`pool`) and each worker
process's entry point (`main`, `python -m captiond.workers.main`), as uvicorn's supervisors.
"""
