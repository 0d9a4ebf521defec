"""python -m tpcomm.doctor"""
import sys

from . import main

sys.exit(main())
