# Writes decode_indexer/revision.h with the checkout's revision, "-dirty" when tracked files
# differ from it, or "unknown" outside a git checkout. Run by the build (target di_revision)
# before anything that prints a version compiles, so a binary built from an incremental build
# names the commit it was built from, not the one its build folder was configured at. The
# header is rewritten only when its text changes: an unchanged revision rebuilds nothing.
#   cmake -DSOURCE_DIR=... -DOUT=.../revision.h -P write_revision.cmake
execute_process(COMMAND git -C ${SOURCE_DIR} rev-parse --short=12 HEAD
                OUTPUT_VARIABLE rev OUTPUT_STRIP_TRAILING_WHITESPACE
                ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR rev STREQUAL "")
  set(rev "unknown")
else()
  execute_process(COMMAND git -C ${SOURCE_DIR} status --porcelain --untracked-files=no
                  OUTPUT_VARIABLE changes OUTPUT_STRIP_TRAILING_WHITESPACE
                  ERROR_QUIET RESULT_VARIABLE rc)
  if(rc EQUAL 0 AND NOT changes STREQUAL "")
    string(APPEND rev "-dirty")
  endif()
endif()
set(text "// Generated at build time by cmake/write_revision.cmake.\n#pragma once\n\n#define DI_GIT_REVISION \"${rev}\"\n")
if(EXISTS ${OUT})
  file(READ ${OUT} old)
else()
  set(old "")
endif()
if(NOT old STREQUAL text)
  file(WRITE ${OUT} "${text}")
endif()
