pub mod pgoutput;
