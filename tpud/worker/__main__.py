import sys

from tpud.worker.entry import main

sys.exit(main())
