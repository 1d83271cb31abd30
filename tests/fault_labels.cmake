# The fault suite's GoogleTest cases (issue #23; the table in docs/faults.md):
# each causes a fault (a kill, a signal, a corrupt or edited file, a full or
# failing disk, a silent or mismatched rank, bad input) and asserts the clear
# error or the correct recovery. ctest reads this file after the discovered
# tests' lists (<binary>_TESTS) and labels the matching ones `fault`, so
# `ctest -L fault` runs the suite; the ctest scripts get the label in
# tests/CMakeLists.txt, the Python tests carry the pytest marker `fault`.
set(_tz_fault_patterns
  # comm: killed and silent ranks, the rendezvous, what the others were doing
  "KilledRank\\." "StalledRank\\." "^PhaseBoard\\." "^RankAgreement\\.SettingsThatDiffer"
  "^Rendezvous\\.(MissingRank|EveryRankNames|CleanRun|StaleFiles|SecondLiveJob)"
  # common: config input, locks, durable files
  "^Config\\.(ANumberBeyondADouble|OneFolderSpeltTwice|CheckPaths|LoadConfigErrors)"
  "^FileLock\\.TheLockEndsWithAProcessKilled" "^LockFile\\." "^DurableFileTest\\.A"
  # nvme: corrupt, truncated, failing and full disks; swap files of dead runs
  "^SwapFiles\\." "^SwapStore\\.(AFlippedByte|ATruncated|StaleData|AFailedWrite|ACapacityBeyond|AFullLoop)"
  "IoEngineBackends\\.(ShortTransfers|EioOnTheNth|ReadingPastTheEnd|AWriteTheDeviceAccepts)"
  # offload: the "auto" NVMe budget names its path
  "^ResolveBudgets\\.AutoNvme"
  # engine: checkpoints, the save lock, reclaim, ranks that differ or die
  "^Checkpoint\\.(AMalformed|AnEdited|CorruptTruncated|ACorrupt|KillDashNine|BadTags|AnotherOptimizers|AModelWithOther|AnNvmeError|AFileChanged|KeepLast|ASaveOntoAFullDisk)"
  "^CheckpointLock\\." "^CheckpointFiles\\.(ACheckpointDirectoryIsFound|ARankFileThatDoesNotFit)" "^SwapReclaim\\."
  "^ZeroEngineRanks\\.(DifferentModels|RanksWithDifferentSettings|AWriteFailing|APutFailing|ARankKilled)"
  # train: the corpus, signals, --save-on-stop, the collective timeout
  "^Corpus\\.ErrorsNameThePath" "^TrainSignals\\." "^TrainCollectiveTimeout\\.")

foreach(_tz_binary common offload nvme comm engine train)
  foreach(_tz_test IN LISTS tierzero_${_tz_binary}_tests_TESTS)
    foreach(_tz_pattern IN LISTS _tz_fault_patterns)
      if(_tz_test MATCHES "${_tz_pattern}")
        set_tests_properties("${_tz_test}" PROPERTIES LABELS fault)
        break()
      endif()
    endforeach()
  endforeach()
endforeach()
