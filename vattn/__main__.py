import sys

from vattn.cli import main

sys.exit(main())
