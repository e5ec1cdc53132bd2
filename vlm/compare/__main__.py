import sys

from vlm.compare.cli import main

sys.exit(main())
